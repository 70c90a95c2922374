"""Resource containment: a job's cores and GPUs as systemd unit properties.

The sdexec service builds one mapper per configuration with
:func:`create_mapper` and calls ``mapper.map(R, extra_properties=...)`` for
each exec::

    mapper = create_mapper(config.mapper, config.mapper_searchpath, rank)
    properties = mapper.map(R, extra_properties=config.sdexec_properties)

:class:`ResourceMapper` dispatches R's resource types to ``map_<type>s``
methods; :class:`HwlocMapper`, the default, maps cores through ``hwloc-calc``
and GPUs through sysfs. Sites subclass either (see ``docs/mapper.md``).
"""

from sdexec.map.cli import main
from sdexec.map.loader import DEFAULT_MAPPER, create_mapper, load_mapper_class
from sdexec.map.mapper import HwlocMapper, ResourceMapper
from sdexec.map.topology import live_topology_xml

__all__ = [
    "DEFAULT_MAPPER",
    "HwlocMapper",
    "ResourceMapper",
    "create_mapper",
    "live_topology_xml",
    "load_mapper_class",
    "main",
]
