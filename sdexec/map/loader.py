"""Finding and building the configured mapper.

``[sdexec] mapper`` names a class as ``package.module.Class``. The module is
looked for first in the ``mapper-searchpath`` directories, as a file
(``<dir>/package/module.py`` or ``<dir>/package/module/__init__.py``), then on
the Python path. A searchpath module is loaded from its file under a private
name, so it cannot clash with an installed module: the spec's own example,
``site.mappers``, shares its first part with Python's ``site``. It is read
afresh on every load, so a reconfiguration picks up an edited mapper. It may
import installed modules, not its own package's siblings.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from sdexec.map.mapper import HwlocMapper, ResourceMapper
from sdexec.map.topology import TopologyXMLError, live_topology_xml

__all__ = ["DEFAULT_MAPPER", "create_mapper", "load_mapper_class"]

DEFAULT_MAPPER = "sdexec.map.HwlocMapper"

#: Flux's own mapper module (flux-config-exec(5)'s default mapper is its
#: ``HwlocMapper``), whose classes sdexec has under ``sdexec.map``.
_FLUX_MAP_MODULE = "flux.sdexec.map"

# Prefix of the sys.modules names searchpath modules are loaded under.
_SEARCHPATH_MODULES = "_sdexec_mapper_searchpath."


def load_mapper_class(
    name: str,
    searchpath: str | Sequence[str] = "",
    *,
    searchpath_name: str = "mapper-searchpath",
) -> type[ResourceMapper]:
    """The class ``name`` (``package.module.Class``), a ResourceMapper subclass.

    Args:
        name: the fully-qualified class name, as ``[sdexec] mapper`` gives it.
        searchpath: directories searched before the Python path, as a
            colon-separated string (``[sdexec] mapper-searchpath``) or a list.
        searchpath_name: what the user wrote the searchpath as, for the
            error when the module is not found (the CLI's ``--searchpath``).

    Raises:
        ValueError: naming the class, when its module cannot be found or
            fails to load, it has no such class, or the class is not a
            subclass of :class:`ResourceMapper`.
    """
    module_name, _, class_name = name.rpartition(".")
    if not module_name or not class_name:
        raise ValueError(
            f"mapper {name!r}: not a fully-qualified class name (package.module.Class)"
        )
    if module_name == _FLUX_MAP_MODULE:
        # Not found, or Flux's classes, which are no sdexec ResourceMapper:
        # either way the error would not say what to write.
        raise ValueError(
            f"mapper {name!r}: {_FLUX_MAP_MODULE} is Flux's module; sdexec's"
            f" is sdexec.map: write sdexec.map.{class_name}"
        )
    directories = _directories(searchpath)
    module = _from_searchpath(module_name, directories, searchpath_name) or _import(
        module_name, directories, searchpath_name
    )
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"mapper {name!r}: {_origin(module)} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, ResourceMapper)):
        raise ValueError(
            f"mapper {name!r} ({_origin(module)}) is not a subclass of"
            " sdexec.map.ResourceMapper"
        )
    return cls


def create_mapper(
    class_name: str = DEFAULT_MAPPER,
    searchpath: str | Sequence[str] = "",
    rank: int = 0,
    topology_xml: str | None = None,
    *,
    searchpath_name: str = "mapper-searchpath",
) -> ResourceMapper:
    """The mapper ``[sdexec] mapper`` asks for, ready to ``map()``.

    The construction rule: a subclass of :class:`HwlocMapper` is built as
    ``cls(xml, rank=rank)``, with ``topology_xml`` or, when that is None, the
    live topology from ``lstopo-no-graphics``; any other
    :class:`ResourceMapper` subclass whose constructor's first parameter is
    positional and not ``rank`` as ``cls(xml, rank)``, as Flux's
    sdexec-mapper builds every class (a mapper written for Flux); any other
    as ``cls(rank=rank)`` (no topology read).
    ``searchpath_name``: as :func:`load_mapper_class` takes it.

    Raises:
        ValueError: the class cannot be loaded (see :func:`load_mapper_class`),
            or the constructor failed.
        OSError: an hwloc tool is missing or failed, or the topology XML is
            not one hwloc could load (EINVAL; a
            :class:`~sdexec.map.topology.TopologyXMLError`, not prefixed with
            the class: the XML is at fault).
    """
    cls = load_mapper_class(class_name, searchpath, searchpath_name=searchpath_name)
    if issubclass(cls, HwlocMapper):
        return _hwloc_mapper(class_name, cls, _xml(topology_xml), rank)
    if _takes_xml(cls):
        return _construct(class_name, cls, _xml(topology_xml), rank)
    return _construct(class_name, cls, rank=rank)


def _xml(topology_xml: str | None) -> str:
    """The topology a mapper is built with: ``topology_xml``, else this
    machine's, read once per mapper built."""
    return live_topology_xml() if topology_xml is None else topology_xml


def _takes_xml(cls: type[ResourceMapper]) -> bool:
    """Whether ``cls`` (no :class:`HwlocMapper`) takes the topology XML
    first, as a mapper written for Flux does: upstream's sdexec-mapper
    builds every class as ``cls(xml, rank)``, and such a class built as
    ``cls(rank=rank)`` failed, missing its ``xml``. A constructor that
    cannot be inspected is built as sdexec's own are."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    return (
        bool(parameters)
        and parameters[0].kind in positional
        and parameters[0].name != "rank"
    )


def _hwloc_mapper(
    class_name: str, cls: type[HwlocMapper], xml: str, rank: int
) -> ResourceMapper:
    """``cls(xml, rank=rank)``, its topology read by hwloc now."""
    mapper = _construct(class_name, cls, xml, rank=rank)
    assert isinstance(mapper, HwlocMapper)  # cls is one
    try:
        # hwloc reads it now: a file it rejects fails the configuration (and
        # the checker), not every job; the first job's pause goes too.
        mapper.topology.load()
    except OSError as error:
        raise OSError(error.errno, f"mapper {class_name!r}: {error.strerror}") from None
    except Exception as error:  # a subclass's own topology, say
        raise ValueError(
            f"mapper {class_name!r}: reading its topology failed:"
            f" {type(error).__name__}: {error}"
        ) from error
    return mapper


def _construct(
    class_name: str, cls: type[ResourceMapper], *args: Any, **kwargs: Any
) -> ResourceMapper:
    """``cls(*args, **kwargs)``, its errors prefixed with the class name.

    OSError stays OSError (the machine is at fault); anything else a
    constructor raises becomes ValueError (the configuration is). A
    :class:`TopologyXMLError` is passed on as it is: the XML's, not the
    class's, for its caller to name where the XML came from.
    """
    try:
        return cls(*args, **kwargs)
    except TopologyXMLError:
        raise
    except OSError as error:
        raise OSError(
            error.errno, f"mapper {class_name!r}: {error.strerror}"
        ) from error
    except ValueError as error:
        raise ValueError(f"mapper {class_name!r}: {error}") from error
    except Exception as error:
        raise ValueError(
            f"mapper {class_name!r}: constructing it failed:"
            f" {type(error).__name__}: {error}"
        ) from error


def _directories(searchpath: str | Sequence[str]) -> list[str]:
    parts = searchpath.split(":") if isinstance(searchpath, str) else searchpath
    return [part for part in parts if part]


def _from_searchpath(
    module_name: str, directories: list[str], searchpath_name: str
) -> ModuleType | None:
    """The module from the searchpath directory that holds it, if one does.

    Flux's sdexec-mapper puts each directory ahead of those listed before it
    on Python's path, so it imports from the *last* that holds the module; a
    module in several is refused rather than loaded from another file than
    Flux would load.
    """
    relative = module_name.replace(".", os.sep)
    found: dict[str, str] = {}  # the file's real path: the file as found
    for directory in directories:
        path = _module_file(directory, relative)
        if path is not None:
            found.setdefault(os.path.realpath(path), path)
    files = list(found.values())
    if len(files) > 1:
        raise ValueError(
            f"mapper module {module_name!r} is in more than one {searchpath_name}"
            f" directory ({', '.join(files)}): Flux's sdexec-mapper imports the"
            f" last ({files[-1]}), as it puts each directory ahead of those listed"
            " before it on Python's path, which the order written does not show:"
            " keep the module in one"
        )
    return _load_file(module_name, files[0]) if files else None


def _module_file(directory: str, relative: str) -> str | None:
    """The file of module ``relative`` in ``directory``: a package before a
    plain module, as Python's import chooses between them."""
    for candidate in (
        os.path.join(directory, relative, "__init__.py"),
        os.path.join(directory, relative + ".py"),
    ):
        if os.path.isfile(candidate):
            return candidate
    return None


def _load_file(module_name: str, path: str) -> ModuleType:
    private_name = _SEARCHPATH_MODULES + module_name
    spec = importlib.util.spec_from_file_location(private_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"mapper module {path}: not loadable as Python")
    module = importlib.util.module_from_spec(spec)
    # Registered before running, as import does, so that dataclasses and
    # pickling in the module can find it by name.
    sys.modules[private_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[private_name]
        raise ValueError(
            f"mapper module {path}: {type(error).__name__}: {error}"
        ) from error
    return module


def _import(
    module_name: str, directories: list[str], searchpath_name: str
) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name + ".").startswith(error.name + "."):
            searched = ":".join(directories) or "empty"
            raise ValueError(
                f"mapper module {module_name!r} is neither in {searchpath_name}"
                f" ({searched}) nor on the Python path"
            ) from None
        raise ValueError(f"mapper module {module_name!r}: {error}") from error
    except Exception as error:
        raise ValueError(
            f"mapper module {module_name!r}: {type(error).__name__}: {error}"
        ) from error


def _origin(module: ModuleType) -> str:
    return getattr(module, "__file__", None) or module.__name__
