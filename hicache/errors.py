"""Exceptions hicache raises to the engine."""


class ConfigError(ValueError):
    """A configuration that cannot be used. The message names the file (if any) and the field."""


class HiCacheError(RuntimeError):
    """Base of hicache's own runtime errors (bad arguments raise ValueError/TypeError)."""


class StateHookError(HiCacheError):
    """The engine's state hook raised. The request is treated as a miss for what it concerned;
    the cache's books are unchanged by the failed call."""


class TierStartError(ConfigError):
    """A tier that cannot start on this machine as configured (a directory it cannot create or
    lock, memory the machine does not have), raised by the tier's constructor or `start`:
    `field` names the setting of the tier's section at fault, `reason` says why in one line.
    Whoever builds the tiers of a configuration sets `tier`, the tier's index in its ``tiers``,
    so that the message names the field as the file does (``tiers.1.path: ...``)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason
        self.tier: int | None = None

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled with its fields, whatever a subclass's constructor takes (a pool of worker
        processes sends it back to the parent)."""
        return _restored, (type(self), self.__dict__)

    def __str__(self) -> str:
        where = "" if self.tier is None else f"tiers.{self.tier}."
        return f"{where}{self.field}: {self.reason}"


def _restored(cls: type[TierStartError], fields: dict[str, object]) -> TierStartError:
    """A `TierStartError` of class `cls` with `fields` (unpickled)."""
    err = cls.__new__(cls)
    err.__dict__.update(fields)
    err.args = (err.field, err.reason)
    return err
