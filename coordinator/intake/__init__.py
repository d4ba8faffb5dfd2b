# An update's way in: validation, authentication, the round's aggregator, divergence, the scratch, what observers hear.
