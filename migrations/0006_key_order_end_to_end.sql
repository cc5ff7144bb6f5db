-- Key order end to end: consumers that gate their records on the state of
-- their business keys (the deferclient package), and keys released only
-- after the consumer group committed past what the scheduler republished
-- (docs/design.md section 23).
--
-- * deferred_message.group_id is the consumer group that deferred the
--   record (defer.group); the key-state query answers per group.
-- * deferred_message.gated marks a record the consumer did not try: its key
--   was blocked, and it was deferred behind the blocking message
--   (defer.gated). History records it as 'gated', not 'deferred'.
-- * deferred_inflight holds, per group and business key, the last record
--   republished to each target partition until the group's committed offset
--   there passes it; the key stays blocked for the group meanwhile.
-- * deferred_attempt records 'published' (with the partition and offset the
--   broker gave) when a message is delivered, so that a message's story no
--   longer ends in silence.
--
-- Changes sql/schema/functions/deferred_key_refresh.sql: a key whose last
-- waiting message is cancelled or parked with release while a dispatcher
-- holds its lease keeps its row, leased and empty (head_id 0), until the
-- holder releases it, so that a message ingested meanwhile waits for the
-- holder instead of being claimed by a second one.
-- Changes sql/schema/functions/deferred_attempt_after_insert.sql: gated
-- rows are recorded as 'gated'.
-- Adds sql/schema/functions/deferred_key_state.sql, the key-state query,
-- and sql/schema/functions/deferred_inflight_after_delete.sql,
-- sql/schema/functions/deferred_inflight_after_truncate.sql and
-- sql/schema/triggers/deferred_inflight.sql: a key stays leased
-- 'in-flight' (dispatch_delete.sql) until its last in-flight row goes.

ALTER TABLE deferred_message
    ADD COLUMN group_id text,
    ADD COLUMN gated boolean NOT NULL DEFAULT false;

-- A rejected message of a group blocks its key for that group like a
-- pending one (the key-state query reads it); rejected rows are few.
CREATE INDEX deferred_message_rejected_key ON deferred_message (business_key) WHERE state = 'rejected';

CREATE TABLE deferred_inflight (
    group_id      text NOT NULL,
    business_key  text NOT NULL,
    target_topic  text NOT NULL,
    partition     int NOT NULL,
    -- The offset of the key's last record the scheduler published there:
    -- the key is released once the group's committed offset is past it.
    record_offset bigint NOT NULL,
    message_id    bigint NOT NULL,
    seq           bigint NOT NULL,
    published_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, business_key, target_topic, partition)
);

CREATE INDEX deferred_inflight_partition ON deferred_inflight (group_id, target_topic, partition, record_offset);

-- The release of a key looks for what is left of it in flight, whatever
-- the group.
CREATE INDEX deferred_inflight_key ON deferred_inflight (business_key);

COMMENT ON TABLE deferred_inflight IS
    'Keys a consumer group has not committed past yet: the last record of each republished to each target partition. Released by the scheduler once the group commits; DELETE releases a key by hand.';

ALTER TABLE deferred_attempt
    ADD COLUMN partition int,
    ADD COLUMN record_offset bigint;

-- NOT VALID, then VALIDATE: the check of existing history rows does not
-- block writers.
ALTER TABLE deferred_attempt DROP CONSTRAINT deferred_attempt_event_valid;
ALTER TABLE deferred_attempt ADD CONSTRAINT deferred_attempt_event_valid
    CHECK (event IN ('deferred', 'gated', 'parked', 'rejected', 'replayed', 'published')) NOT VALID;
ALTER TABLE deferred_attempt VALIDATE CONSTRAINT deferred_attempt_event_valid;
