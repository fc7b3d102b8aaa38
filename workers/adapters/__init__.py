"""Provider adapters: run exactly the target they are handed, on one provider.

``factory.make_adapter`` picks the one for a provider type.
"""
