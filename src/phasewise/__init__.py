"""phasewise: an event-streaming resource manager for deep-learning clusters."""

__version__ = "0.1.0"
