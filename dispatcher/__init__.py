"""The library the API and the workers share: config, keys, Lua scripts, dispatch calls."""
