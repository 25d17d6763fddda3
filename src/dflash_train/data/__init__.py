"""Raw rows -> tokens with loss masks (`prepare`), the lazy Arrow dataset, the batch planner.

Modules (imported on use, so importing the package stays cheap): `sources` (reading rows),
`render` (chat template -> input_ids + loss_mask), `prepare`/`prepare_cli` (the job),
`dataset` (`TokenDataset`), `batch` (`PackedBatch`, `pack_documents`), `batching`
(`BatchPlanConfig`, `BatchPlanner`). See docs/data.md.
"""
