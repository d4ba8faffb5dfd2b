# The round loop and what it drives: presence, publishing, closing, evaluation, the round mode seam.
