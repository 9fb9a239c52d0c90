"""What a run reports about itself: metrics, sinks, monitor, progress, summary, watchdog and health checks."""
