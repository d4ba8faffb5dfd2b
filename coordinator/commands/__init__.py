# The fl-coordinator commands, one module each, with the option groups and settings they parse.
