"""The node's HTTP surface: a Starlette app served by Hypercorn on trio."""
