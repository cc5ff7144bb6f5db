-- One list of reason codes, and a history that tells every end of a story
-- and who acted.
--
-- * Reasons are "code: detail" with a code from package reason. Dispatch
--   used to store "publish_failed: unknown_topic: ..." and an operator's park
--   "parked by operator: ...", whose codes (split_part(reason, ':', 1)) were
--   publish_failed and "parked by operator", not the unknown_topic and
--   operator that the metrics, the README and `--reason` say. Existing
--   messages and history rows are rewritten to "unknown_topic: ..." and
--   "operator: ...". The triggers of deferred_message are disabled for that
--   statement only: a reason's wording is no change of the message (its
--   updated_at stays) and touches neither its key nor its history.
-- * deferred_attempt.actor: who made the change, from the transaction
--   setting scheduler.actor (operate.SetActor: 'cli:alice', 'console:bob'),
--   else the database's session_user (an operator with psql). NULL for the
--   service's own events: ingest's inserts and dispatch's finalize (publish,
--   park), and rows recorded before this migration.
-- * Two events: 'cancelled', when a message row is deleted by anyone but
--   dispatch's finalize, and 'expedited', when a pending message is made
--   due earlier.
-- * target_control_history: every change of a target's pause, rate limit
--   or note, with who and when. The dispatchers' token updates do not write
--   it.
--
-- Changes sql/schema/functions/deferred_attempt_after_update.sql: records
-- 'expedited' and the actor.
-- Adds sql/schema/functions/deferred_attempt_after_delete.sql and its trigger
-- in sql/schema/triggers/deferred_message.sql: records 'cancelled'.
-- Adds sql/schema/functions/target_control_record.sql and its triggers in
-- sql/schema/triggers/target_control.sql: fills target_control_history.

ALTER TABLE deferred_message DISABLE TRIGGER USER;
UPDATE deferred_message
SET reason = substr(reason, length('publish_failed: ') + 1)
WHERE reason LIKE 'publish\_failed: %';
UPDATE deferred_message
SET reason = 'operator' || substr(reason, length('parked by operator') + 1)
WHERE reason LIKE 'parked by operator%';
ALTER TABLE deferred_message ENABLE TRIGGER USER;

UPDATE deferred_attempt
SET reason = substr(reason, length('publish_failed: ') + 1)
WHERE reason LIKE 'publish\_failed: %';
UPDATE deferred_attempt
SET reason = 'operator' || substr(reason, length('parked by operator') + 1)
WHERE reason LIKE 'parked by operator%';

ALTER TABLE deferred_attempt ADD COLUMN actor text;
ALTER TABLE deferred_attempt DROP CONSTRAINT deferred_attempt_event_valid;
ALTER TABLE deferred_attempt ADD CONSTRAINT deferred_attempt_event_valid
    CHECK (event IN ('deferred', 'gated', 'parked', 'rejected', 'replayed', 'published', 'cancelled', 'expedited')) NOT VALID;
ALTER TABLE deferred_attempt VALIDATE CONSTRAINT deferred_attempt_event_valid;

CREATE TABLE target_control_history (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    target_topic text NOT NULL,
    changed_at   timestamptz NOT NULL DEFAULT now(),
    actor        text NOT NULL,
    -- insert, update or delete: what happened to the target_control row.
    change       text NOT NULL,
    -- The row's settings after the change (NULL after a delete).
    paused       boolean,
    rate_limit   double precision,
    note         text,

    CONSTRAINT target_control_history_change_valid CHECK (change IN ('insert', 'update', 'delete'))
);

COMMENT ON TABLE target_control_history IS
    'Every change of a target''s pause, rate limit or note in target_control, with who and when. Written by triggers on target_control.';

CREATE INDEX target_control_history_target ON target_control_history (target_topic, id);

COMMENT ON TABLE deferred_attempt IS
    'History of every message lineage: deferrals, parks, rejections, replays, expedites, cancels and deliveries, and who acted. Written by triggers on deferred_message and by dispatch''s finalize; pruned after HISTORY_RETENTION.';
