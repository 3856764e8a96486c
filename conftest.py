pytest_plugins = ["dcpcheck.plugin"]
