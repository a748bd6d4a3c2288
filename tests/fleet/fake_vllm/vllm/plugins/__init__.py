"""vLLM's general-plugin loader, reduced to its contract."""

import logging
import os
from importlib.metadata import entry_points

logger = logging.getLogger(__name__)
DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
plugins_loaded = False


def load_plugins_by_group(group):
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else [name for name in allowed.split(",") if name]
    plugins = {}
    for plugin in entry_points(group=group):
        if allowed is None or plugin.name in allowed:
            try:
                plugins[plugin.name] = plugin.load()
            except Exception:
                logger.exception("Failed to load plugin %s", plugin.name)
    return plugins


def load_general_plugins():
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    for func in load_plugins_by_group(DEFAULT_PLUGINS_GROUP).values():
        func()
