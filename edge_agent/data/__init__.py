# A device's data: its image store, labelled record and journal, datasets, image files and the oracle interface.
