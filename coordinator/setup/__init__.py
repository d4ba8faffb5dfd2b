# What a run starts from: its settings, the server's data and W0, resuming from the store, the round's encoder.
