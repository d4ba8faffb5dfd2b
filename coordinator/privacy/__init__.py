# Private rounds (DP-FedAvg): the noised aggregator, Poisson sampling, each round's plan and the spent budget.
