"""The one exception type a user can act on: the CLI prints its message and exits 2."""


class PtqError(Exception):
    """A user mistake (bad path, bad recipe, unsuitable model or data), with how to fix it."""
