"""The relay: a small self-hostable server that forwards frames between nodes
that cannot reach each other directly, and answers STUN binding requests.

- ``protocol``: the relay frame codec (no I/O)
- ``stun``: the STUN binding codec, on aioice's ``stun`` module (no I/O)
- ``ratelimit``: the per-client token bucket (time is an argument)
- ``wsframe``: WebSocket framing (no I/O)
- ``wsconn``: a WebSocket connection: the upgrade, then frames read and written without a task per message
- ``server``: ``serve_relay`` and the ``Relay`` state behind its snapshot
- ``client``: ``RelayClient`` (connect, authenticate, reconnect) and ``stun_query``
- ``cli``: the ``meshd relay`` command
"""
