-- iceberg_idempotency PostgreSQL store, schema version 2: sealed responses.
--
-- Adds key_id, the identifier of the secret (the handler's `secret` option)
-- a final response was encrypted under. A row with key_id set holds the
-- AES-256-GCM ciphertext of the status, replayed headers and body in body,
-- and NULL status and headers. A row with key_id NULL is a clear-text
-- response, as every row written before this version is: those rows keep
-- replaying unchanged.
--
-- Apply after 0001_records.sql. The column is NULL-able without a default,
-- so adding it only changes the catalog: no table rewrite, no long lock.
--
-- TABLE NAME PLACEHOLDER: as in 0001_records.sql, every occurrence of
-- "iceberg_idempotency_records" stands for the configured table name. To
-- apply the file by hand with another table name:
--
--   sed 's/iceberg_idempotency_records/my_records/g' 0002_key_id.sql \
--     | psql --single-transaction -v ON_ERROR_STOP=1 "$DATABASE_URL"
--
-- The file is idempotent (safe to run again). Every statement ends with ';'
-- at the end of a line: the store splits the file there.

-- key_id: NULL for a clear-text response, else the id of the sealing secret.
ALTER TABLE iceberg_idempotency_records
    ADD COLUMN IF NOT EXISTS key_id varchar(64);

INSERT INTO iceberg_idempotency_records_schema (version) VALUES (2)
    ON CONFLICT (version) DO NOTHING;
