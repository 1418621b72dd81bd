"""SWIM + Lifeguard membership, sans-IO: no trio, no sockets, no clock reads."""

from .config import LAN, LOCAL, PROFILES, WAN, Config, suspicion_timeout
from .core import Swim
from .state import Event, EventKind, Member, Outgoing, State

__all__ = [
    "Config", "LAN", "LOCAL", "PROFILES", "WAN", "suspicion_timeout",
    "Swim", "Event", "EventKind", "Member", "Outgoing", "State",
]
