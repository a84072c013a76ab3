"""What every parallelism stands on: the mesh of ranks and process groups, the log of every collective, the shard records, the zig-zag sequence split."""
