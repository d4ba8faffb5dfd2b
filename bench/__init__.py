# The bench room: simulated fleets on one machine (simulate, partitions, shards, simulated oracles, camera scenes); no runtime module imports it.
