"""Differential privacy of what a site releases: the mechanisms and their accountant.

The unit protected is one training image of a site, or one patient (a group of at most k
images per class: the count and moment sensitivities × k; docs/security.md#differential-privacy):
every release that can depend on an image — its class's noisy count, mixture statistics and the
site's tensor updates of that image's task — is a Gaussian mechanism, and the accountant
composes them per class (``accountant``); ``mechanisms`` clips and adds the noise.
"""
