"""Decoder registry: the only list of decoder names in the library.

    # decoders/mydecoder.py
    @register("mydecoder")
    class MyDecoder(Decoder): ...

A decoder of this package is registered under its module's name, the name a user types after
`--decoder`; registering a name twice, or under another name than the module's, is an error.
`build_decoder("name", ...)` instantiates one. Every module of this package is imported below, so
a new file in `decoders/` registers its decoder by being there.
"""
from __future__ import annotations

from typing import Callable

from datamodules.vocabulary import SpecialTokens
from decoders.base import DecodeOutput, Decoder

_REGISTRY: dict[str, type[Decoder]] = {}


def register(name: str) -> Callable[[type[Decoder]], type[Decoder]]:
    def add(cls: type[Decoder]) -> type[Decoder]:
        if name in _REGISTRY:
            raise ValueError(f"decoder name {name!r} is already registered by "
                             f"{_REGISTRY[name].__module__}.{_REGISTRY[name].__qualname__}")
        if not (isinstance(cls, type) and issubclass(cls, Decoder)):
            raise TypeError(f"@register({name!r}) must decorate a subclass of decoders.base.Decoder")
        package, _, module = cls.__module__.rpartition(".")
        if package == __name__ and module != name:
            raise ValueError(f"{cls.__module__}.{cls.__qualname__} is registered as {name!r}; a "
                             f"decoder of this package is registered under its module's name, "
                             f"{module!r}")
        cls.name = name
        cls.layout_family = cls.__dict__.get("layout_family") or name
        _REGISTRY[name] = cls
        return cls
    return add


def available() -> list[str]:
    return sorted(_REGISTRY)


def decoder_class(name: str) -> type[Decoder]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown decoder {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name]


def build_decoder(name: str, backbone_config, special: SpecialTokens, compile: bool = False,
                  **options) -> Decoder:
    """Decoder `name` with its own `options`, and those every decoder shares
    (`Decoder.shared_decode_options`): `compile` runs its encoder pass and its calls' model step
    through torch.compile."""
    decoder = decoder_class(name)(backbone_config, special, **options)
    decoder.compiled_calls = bool(compile)
    return decoder


def _import_all_decoder_modules() -> None:
    import importlib
    import pkgutil
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_all_decoder_modules()

__all__ = ["Decoder", "DecodeOutput", "SpecialTokens", "register", "available", "decoder_class",
           "build_decoder"]
