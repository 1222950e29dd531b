"""The project's one name: pluggy project, entry-point group and marker."""

from __future__ import annotations

NAME = "turbospark"
INSTALL_FORMAT = "turbospark-install"
INSTALL_FORMAT_VERSION = 1
