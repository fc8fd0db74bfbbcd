"""Why the KV manager refuses a request or a model (raised before anything is allocated)."""


class MepicCapacityError(ValueError):
    """A request that can never fit the KV pool, even with every idle chunk evicted."""


class MepicUnsupportedError(ValueError):
    """A model or configuration MEPIC's scheduling path cannot serve."""
