"""KV connectors for vLLM V0: FSConnector and MultiConnectorV0.

Only `store_format` and `config` may be imported without torch and vLLM
(kvctl uses them); the connector modules are loaded by vLLM through the
plugin in `connectors.plugin`.
"""
