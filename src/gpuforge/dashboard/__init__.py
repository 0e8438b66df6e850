"""The web dashboard: its pages (static files served by the server and by `gpuforge dashboard`), the
comparison of runs both serve, and the read-only app over local run directories (docs/dashboard.md)."""
