-- iceberg_idempotency MySQL / MariaDB store, schema version 2: sealed
-- responses. Tested on MariaDB 10.11; written to work on MySQL 8 as well.
--
-- Adds key_id, the identifier of the secret (the handler's `secret` option)
-- a final response was encrypted under. A row with key_id set holds the
-- AES-256-GCM ciphertext of the status, replayed headers and body in body,
-- and NULL status and headers. A row with key_id NULL is a clear-text
-- response, as every row written before this version is: those rows keep
-- replaying unchanged.
--
-- Apply after 0001_records.sql. Appending a NULL-able column is an instant
-- (metadata-only) change on MariaDB 10.3+ and MySQL 8.0.12+.
--
-- TABLE NAME PLACEHOLDER: as in 0001_records.sql, every occurrence of
-- "iceberg_idempotency_records" stands for the configured table name (here
-- also in a string literal, a session variable and a prepared statement
-- name). To apply the file by hand with another table name:
--
--   sed 's/iceberg_idempotency_records/my_records/g' 0002_key_id.sql \
--     | mysql my_database
--
-- The file is idempotent (safe to run again). MySQL has no ADD COLUMN IF
-- NOT EXISTS (MariaDB has), so the ALTER is built only when the column is
-- missing, and a no-op (DO 0) runs otherwise; the statements must run in
-- one session, as both the mysql client and the store run them. Every
-- statement ends with ';' at the end of a line: the store splits the file
-- there, so no line inside a statement may end with one.

SET @iceberg_idempotency_records_v2 = (
    SELECT IF(COUNT(*) = 0,
        'ALTER TABLE iceberg_idempotency_records ADD COLUMN key_id VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NULL',
        'DO 0')
    FROM information_schema.columns
    WHERE table_schema = DATABASE()
      AND table_name = 'iceberg_idempotency_records'
      AND column_name = 'key_id'
);
PREPARE iceberg_idempotency_records_v2 FROM @iceberg_idempotency_records_v2;
EXECUTE iceberg_idempotency_records_v2;
DEALLOCATE PREPARE iceberg_idempotency_records_v2;

INSERT INTO iceberg_idempotency_records_schema (version, applied_at)
    VALUES (2, UTC_TIMESTAMP(6))
    ON DUPLICATE KEY UPDATE version = version;
