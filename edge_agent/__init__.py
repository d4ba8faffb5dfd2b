# Edge agent: what runs on a device (no imports of coordinator/ or export/).
