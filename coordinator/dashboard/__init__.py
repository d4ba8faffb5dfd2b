# The coordinator's web dashboard: live state, JSON API, Prometheus metrics, and the self-contained run report.
