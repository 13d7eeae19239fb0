"""What the engine tells about itself: statistics, latency histograms, the event loop's
lag, Prometheus metrics and KV events for routers."""
