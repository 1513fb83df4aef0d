"""What the tests share, imported by them and never collected: processes and waits, the
kernel's one-claim helpers, operators and browsers, private PostgreSQL clusters, PgBouncer,
network namespaces, the runtime role, the docs' code blocks."""
