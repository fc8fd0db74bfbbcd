"""Why the KV manager refuses a request or a model (raised before anything is allocated)."""


class MepicCapacityError(ValueError):
    """A request that can never fit the KV pool, even with every idle chunk evicted."""


class MepicQuotaError(MepicCapacityError):
    """A chunk registration past a pinned-KV limit (engine-wide or per cache salt): refused at
    arrival, before anything is allocated or evicted, so other requests never notice it."""


class MepicUnsupportedError(ValueError):
    """A model or configuration MEPIC's scheduling path cannot serve."""
