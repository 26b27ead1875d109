-- iceberg_idempotency MySQL / MariaDB store, schema version 1.
-- Tested on MariaDB 10.11; written to work on MySQL 8 as well.
--
-- TABLE NAME PLACEHOLDER: every occurrence of "iceberg_idempotency_records"
-- in this file (the default table name, also the prefix of the version table
-- and of the index) stands for the configured table name. The store
-- substitutes it itself when auto_migrate is on. To apply the file by hand
-- with another table name, replace it the same way, for example:
--
--   sed 's/iceberg_idempotency_records/my_records/g' 0001_records.sql \
--     | mysql my_database
--
-- The file is idempotent (safe to run again): MySQL commits each DDL
-- statement on its own, so a half-applied file is finished by running it
-- again. Every statement ends with ';' at the end of a line: the store splits
-- the file there.

-- One row per applied schema version; the store refuses to start (or
-- migrates, with auto_migrate) when the latest version is missing.
CREATE TABLE IF NOT EXISTS iceberg_idempotency_records_schema (
    version    INT         NOT NULL,
    applied_at DATETIME(6) NOT NULL, -- UTC
    PRIMARY KEY (version)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

-- One row per Idempotency-Key. Times are DATETIME(6) in UTC, written and
-- compared with the database clock (UTC_TIMESTAMP(6)), never a Caddy node's
-- clock. Binary collations: keys and owner tokens compare byte for byte.
CREATE TABLE IF NOT EXISTS iceberg_idempotency_records (
    `key`       VARCHAR(36)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL, -- the Idempotency-Key (lowercase UUID)
    operation   VARCHAR(255) NOT NULL, -- Iceberg REST operationId the key is bound to
    path        TEXT         NOT NULL, -- escaped request path the key is bound to
    principal   VARCHAR(255) NOT NULL, -- hex SHA-256 of the caller
    fingerprint VARCHAR(255) NOT NULL, -- hex SHA-256 of method, path, query, body
    state       VARCHAR(16)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL, -- in_flight or final
    owner       VARCHAR(255) NULL,     -- token of the owning reservation; NULL once final
    lease_until DATETIME(6)  NULL,     -- in flight: abandoned once lease_until <= UTC_TIMESTAMP(6)
    created_at  DATETIME(6)  NOT NULL,
    expires_at  DATETIME(6)  NOT NULL, -- the row behaves as absent once expires_at <= UTC_TIMESTAMP(6)
    status      INT          NULL,     -- final: HTTP status code
    headers     MEDIUMTEXT   NULL,     -- final: JSON object of the replayed (allow-listed) headers
    body        LONGBLOB     NULL,     -- final: response body, byte for byte (needs max_allowed_packet above the largest body)
    PRIMARY KEY (`key`),
    -- PurgeExpired scans expired rows oldest first.
    INDEX iceberg_idempotency_records_expires_at_idx (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin;

INSERT INTO iceberg_idempotency_records_schema (version, applied_at)
    VALUES (1, UTC_TIMESTAMP(6))
    ON DUPLICATE KEY UPDATE version = version;
