# The strategies: the contract, the registry, each method or family, and the aggregation math beside them.
