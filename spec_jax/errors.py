"""The one exception type users catch: every message names the problem and the fix."""


class SpecJaxError(Exception):
    """Bad input or state that the user can fix; the message says how."""
