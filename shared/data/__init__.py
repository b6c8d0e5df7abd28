"""Images and data sets: Split CropDiseases, decoding and augmentation, federated scenarios."""
