-- The consumers' blocked-key sets: a feed of the keys that may have become
-- blocked or free for a consumer group.
--
-- Adds the tables deferred_key_change and deferred_key_change_pruned, and
-- these definitions, which write them:
--   sql/schema/functions/deferred_key_change_after_insert.sql
--   sql/schema/functions/deferred_key_change_after_update.sql
--   sql/schema/functions/deferred_key_change_after_delete.sql
--   sql/schema/functions/deferred_key_change_released.sql
--   sql/schema/functions/deferred_key_change_reset.sql
--   sql/schema/triggers/deferred_message.sql
--   sql/schema/triggers/deferred_inflight.sql
--
-- The client library used to ask the scheduler about the keys of every
-- batch of main-topic records: three index probes per record, whatever was
-- deferred. It now loads its group's blocked keys once per assignment
-- (POST /v1/key-set) and follows this feed (POST /v1/key-changes), so
-- that the database works per deferral and release, not per record
-- (docs/design.md, "The blocked-key set"). A process of an earlier release
-- writes the rows through the same triggers, and serves neither endpoint.
-- The trigger functions write a table the operator cannot: run
-- sql/roles/grants.sql again after this migration. The index
-- deferred_message_group_key serves the loads; it costs a grouped
-- deferral one index entry.
CREATE TABLE deferred_key_change (
    xid          xid8 NOT NULL DEFAULT pg_current_xact_id(),
    group_id     text NOT NULL,
    business_key text COLLATE "C" NOT NULL,
    changed_at   timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE deferred_key_change IS
    'Feed of (consumer group, business key) pairs whose blocked state may have changed, by transaction id; read by the key-changes query, pruned after minutes. Written by triggers.';

CREATE INDEX deferred_key_change_feed ON deferred_key_change (group_id, xid);
CREATE INDEX deferred_key_change_age ON deferred_key_change USING brin (changed_at);

CREATE TABLE deferred_key_change_pruned (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    below    xid8 NOT NULL
);

-- A consumer group's blocked keys, in key order, for the clients' set
-- loads (sql/queries/key_set.sql): by group, not by walking every group's
-- pending rows. Partial: messages that name no group cost it nothing.
CREATE INDEX deferred_message_group_key
    ON deferred_message (group_id, business_key)
    WHERE group_id IS NOT NULL AND (state IN ('pending', 'rejected') OR (state = 'parked' AND park_holds_key));
