# Secure aggregation (SecAgg+, Bell et al. 2020), the pure part devices and coordinator share: no torch, no I/O.
