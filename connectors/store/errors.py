"""The root of every error the store raises (its own module: format and auth both raise from it)."""


class StoreError(Exception):
    """Root of everything connectors.store raises about a store or an entry."""
