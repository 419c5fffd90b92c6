"""Configuration: one typed config from five sources, with provenance.

* :mod:`torchrig.config.loader` — YAML/JSON files with line marks, duplicate keys rejected (the
  :class:`~torchrig.config.document.Document` it returns; the pyyaml-based parsing in
  :mod:`torchrig.config.parsing`, imported only when a file is read);
* :mod:`torchrig.config.schema` — declaring options (:func:`option`) and coercing values;
* :mod:`torchrig.config.options` — the core's options (Accelerate's class names);
* :mod:`torchrig.config.sections` — which keys exist (:class:`~torchrig.config.sections.Schema`), each
  plugin's options class imported only when its section is used;
* :mod:`torchrig.config.sources` — where a value came from (layers, sources);
* :mod:`torchrig.config.resolve` — precedence, provenance, validation (:func:`resolve_config`), in steps:
  :mod:`~torchrig.config.readers` (each source into entries), :mod:`~torchrig.config.merge` (layering,
  coercion, options objects), :mod:`~torchrig.config.cross_checks` (checks between keys, plugins' checks);
* :mod:`torchrig.config.resolved` — the result (:class:`~torchrig.config.resolved.ResolvedConfig`);
* :mod:`torchrig.config.flags` — command-line flags for configuration keys;
* :mod:`torchrig.config.compat` — what happens to each key of Accelerate's config files.
"""
