"""The serving goals (serve-latency, serve-throughput, serve-disagg): memory, step time, batch choice, queueing, rates, calibration."""
