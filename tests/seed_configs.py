"""The seed's --kv-transfer-config for P and D, verbatim (tests check they stay valid)."""

import json

SEED_P = json.loads('{"kv_connector":"MultiConnectorV0","kv_role":"kv_both","kv_connector_extra_config":'
                    '{"connectors":[{"kv_connector":"FSConnector","kv_role":"kv_producer",'
                    '"kv_connector_extra_config":{"fs_storage_path":"fs_local_storage","transfer":true}},'
                    '{"kv_connector":"LMCacheConnector","kv_role":"kv_both"}]}}')
SEED_D = json.loads('{"kv_connector":"FSConnector","kv_role":"kv_consumer",'
                    '"kv_connector_extra_config":{"fs_storage_path":"fs_local_storage"}}')
