"""twistd plugin: ``twistd -n sdexec --config FILE [--listen EP] [--stats EP]
[--bus user|system]``.

``twisted.plugins`` is a namespace package here (no ``__init__.py``, by
Twisted's plugin convention): the wheel installs this one file into Twisted's
own ``twisted/plugins/`` directory; in a checkout it is found when the
checkout is on ``sys.path`` (``scripts/install`` makes it so).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn

from twisted.application.service import IServiceMaker
from twisted.logger import Logger
from twisted.plugin import IPlugin
from twisted.python import usage
from zope.interface import implementer

if TYPE_CHECKING:
    from twisted.application.service import IService
    from twisted.internet.asyncioreactor import AsyncioSelectorReactor

log = Logger()


class Options(usage.Options):
    """``twistd sdexec``'s options: the configuration file, and the settings
    a unit's command line may give over it."""

    optParameters = [  # noqa: RUF012 - Twisted's usage.Options convention
        [
            "config",
            "c",
            None,
            "configuration file (TOML, JSON or YAML), or a directory of"
            " *.toml files, as Flux reads its conf.d",
        ],
        [
            "listen",
            "l",
            None,
            "endpoint for requests (default: [sdexec] listen, else"
            " unix:$XDG_RUNTIME_DIR/sdexec/sdexec.sock)",
        ],
        [
            "stats",
            "s",
            None,
            "endpoint for GET /stats and /metrics (default: [sdexec] stats,"
            " else tcp:8490:interface=127.0.0.1)",
        ],
        [
            "bus",
            "b",
            None,
            "the manager that runs the units, user or system (default:"
            " [systemd] bus, else user); the system unit gives system",
        ],
    ]

    def parseOptions(self, options: list[str] | None = None) -> None:
        """twistd's own parse, but a usage error is one line and
        ``EX_CONFIG``: twistd would print its whole usage and exit 1, which
        the units restart every 5 s for ever (a typo in ``ExecStart=``)."""
        try:
            super().parseOptions(options)
        except usage.UsageError as error:
            _refuse_to_start(str(error))

    def opt_help(self) -> NoReturn:
        """Display this help and exit."""
        # Twisted's own prints it unchecked: a traceback on a full disk.
        from sdexec.cliparser import write_stdout_or_exit

        write_stdout_or_exit("twistd sdexec", f"{self}\n")
        raise SystemExit(0)

    def opt_version(self) -> NoReturn:
        """Display sdexec's version and Twisted's, and exit."""
        # Twisted's own says only "Twisted version: …": after an upgrade, an
        # admin asking which sdexec the unit's twistd runs was not told.
        from sdexec.cliparser import write_stdout_or_exit
        from sdexec.version import package_version
        from twisted import __version__ as twisted_version

        write_stdout_or_exit(
            "twistd sdexec", f"sdexec {package_version()} (Twisted {twisted_version})\n"
        )
        raise SystemExit(0)

    def postOptions(self) -> None:
        """Refuse a start without ``--config``."""
        if not self["config"]:
            raise usage.UsageError("--config FILE is required")


def _refuse_to_start(reason: str, transient: bool = False) -> NoReturn:
    """End with ``reason`` in one line and ``EX_CONFIG``, the status of a
    start that would fail again as it is: the units do not restart it
    (``RestartPreventExitStatus=``). ``transient``: the same start may pass
    later (an ``allow-users`` name sssd cannot resolve yet at boot), so
    status 1, which they restart, within their start limit."""
    # Imported here, as in makeService: twistd imports every plugin to
    # list its commands, and sdexec's modules are not needed for that.
    from sdexec.service import EX_CONFIG

    print(f"sdexec: {reason}", file=sys.stderr)
    raise SystemExit(1 if transient else EX_CONFIG)


def _asyncio_reactor() -> AsyncioSelectorReactor:
    """The reactor, which must be Twisted's asyncio reactor: dbus-fast is
    asyncio-based. Installs it if no reactor is installed yet."""
    if "twisted.internet.reactor" not in sys.modules:
        from twisted.internet import asyncioreactor

        asyncioreactor.install()
    from twisted.internet import reactor
    from twisted.internet.asyncioreactor import AsyncioSelectorReactor

    if not isinstance(reactor, AsyncioSelectorReactor):
        _refuse_to_start(
            f"sdexec needs the asyncio reactor, not {type(reactor).__name__}:"
            " run twistd with --reactor=asyncio (or without --reactor)"
        )
    return reactor


@implementer(IServiceMaker, IPlugin)
class SdexecServiceMaker:
    """What twistd finds as its ``sdexec`` command."""

    tapname = "sdexec"
    description = "Run processes as transient systemd units (RFC 42 server)"
    options = Options

    def makeService(self, options: Options) -> IService:
        """The service of ``options``, logging as twistd's log options say;
        a configuration that cannot start ends the process (EX_CONFIG)."""
        reactor = _asyncio_reactor()
        from sdexec.config import ConfigError, check_command_line_option, load_config
        from sdexec.fdlimit import raise_open_file_limit
        from sdexec.logs import log_observer, with_observer
        from sdexec.service import SdexecService
        from sdexec.version import package_version

        try:
            config = load_config(options["config"])
            service = SdexecService(
                config,
                reactor,
                check_command_line_option("--listen", options["listen"]),
                check_command_line_option("--stats", options["stats"]),
                exit_on_failure=True,
                bus=check_command_line_option("--bus", options["bus"]),
            )
        except ConfigError as error:
            _refuse_to_start(str(error), transient=error.transient)
        # Which sdexec runs, in the log of every start: after an upgrade
        # twistd's own first line names Twisted's version, not sdexec's.
        log.info("sdexec {version}", version=package_version())
        raised = raise_open_file_limit()
        if raised is not None:
            log.info(
                "open-file limit (RLIMIT_NOFILE) raised from {old} to {new}",
                old=raised[0],
                new=raised[1],
            )
        if not _twistd_logs_to_stdout(options):
            # twistd's own observer writes its --logfile: log-format, which
            # writes to standard output, would take its place, and a daemon's
            # standard output goes nowhere.
            if config.sdexec.log_format != "text":
                log.warn(
                    "sdexec.log-format = {chosen!r} applies to standard output"
                    " (twistd -n without --logfile): twistd writes its log file"
                    " as text",
                    chosen=config.sdexec.log_format,
                )
            return service
        # twistd -n logs to stdout: the journal under systemd (sdexec/logs.py).
        observer = log_observer(config.sdexec.log_format, sys.stdout, os.environ)
        return with_observer(service, observer)


def _twistd_logs_to_stdout(options: Options) -> bool:
    """Whether twistd logs to standard output, as it decides it: ``--logfile
    -``, or ``-n`` without ``--logfile`` or ``--syslog`` (the unit files'
    way). Without twistd's options (a plugin made by hand), standard
    output."""
    twistd = getattr(options, "parent", None)
    if twistd is None:
        return True
    if twistd.get("syslog"):
        return False
    logfile = twistd.get("logfile")
    return logfile == "-" or (not logfile and bool(twistd.get("nodaemon")))


serviceMaker = SdexecServiceMaker()
