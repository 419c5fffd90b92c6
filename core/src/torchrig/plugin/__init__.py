"""What a plugin is made of: the hook contract (:mod:`.hookspecs`), its pluggy markers (:mod:`.markers`),
plugin kinds and entry-point groups (:mod:`.kinds`), the interface tracker plugins implement (:mod:`.tracker`), the torch-free manifest (:mod:`.manifest`) and the
plain data exchanged through hooks (:mod:`.types`).
"""
