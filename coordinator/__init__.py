# The coordinator: two assemblies (server.py for a fleet, relay.py for a site) over rooms, and its command line.
