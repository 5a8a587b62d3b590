"""OpenTelemetry setup and trace-context propagation through events."""
