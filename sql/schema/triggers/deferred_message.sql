-- The triggers of deferred_message.
--
-- deferred_key is derived state: the AFTER statement triggers deferred_key_*
-- keep it true for every statement, the service's own and an operator's
-- alike (functions/deferred_key_after_*.sql). The deferred_attempt_*
-- triggers write the attempt history. deferred_message_touch keeps
-- updated_at and parked_at. Triggers of the same event fire in name order.
--
-- CREATE OR REPLACE TRIGGER (PostgreSQL 14+), so that `scheduler migrate`
-- can apply this file again: it takes a SHARE ROW EXCLUSIVE lock on the
-- table (writes wait, reads do not) until the migration commits. A trigger
-- removed from this file is not dropped by that: drop it in a numbered
-- migration.

CREATE OR REPLACE TRIGGER deferred_key_insert AFTER INSERT ON deferred_message
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_after_insert();

CREATE OR REPLACE TRIGGER deferred_key_update AFTER UPDATE ON deferred_message
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_after_update();

CREATE OR REPLACE TRIGGER deferred_key_delete AFTER DELETE ON deferred_message
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_after_delete();

-- TRUNCATE fires no DELETE trigger; without this, heads would point at
-- messages that no longer exist.
CREATE OR REPLACE TRIGGER deferred_key_truncate AFTER TRUNCATE ON deferred_message
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_after_truncate();

-- updated_at follows every change an operator or the service makes;
-- parked_at follows the state.
CREATE OR REPLACE TRIGGER deferred_message_touch BEFORE UPDATE ON deferred_message
    FOR EACH ROW EXECUTE FUNCTION deferred_message_touch();

-- History: one deferred_attempt row per thing that happened to a message.
CREATE OR REPLACE TRIGGER deferred_attempt_insert AFTER INSERT ON deferred_message
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_attempt_after_insert();

CREATE OR REPLACE TRIGGER deferred_attempt_update AFTER UPDATE ON deferred_message
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_attempt_after_update();

-- 'cancelled': a message deleted by anyone but dispatch's finalize, which
-- sets scheduler.finalizing and records 'published' itself. The WHEN test
-- keeps the finalize's deletes, the hot path, from even calling the
-- function.
CREATE OR REPLACE TRIGGER deferred_attempt_delete AFTER DELETE ON deferred_message
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT
    WHEN (nullif(current_setting('scheduler.finalizing', true), '') IS NULL)
    EXECUTE FUNCTION deferred_attempt_after_delete();

-- The consumers' blocked-key sets: a change that may block or free a key
-- for a consumer group is written to deferred_key_change
-- (functions/deferred_key_change_*.sql). The finalize's deletes are not:
-- the same statement puts the key in flight.
CREATE OR REPLACE TRIGGER deferred_key_change_insert AFTER INSERT ON deferred_message
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_change_after_insert();

CREATE OR REPLACE TRIGGER deferred_key_change_update AFTER UPDATE ON deferred_message
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_change_after_update();

CREATE OR REPLACE TRIGGER deferred_key_change_delete AFTER DELETE ON deferred_message
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT
    WHEN (nullif(current_setting('scheduler.finalizing', true), '') IS NULL)
    EXECUTE FUNCTION deferred_key_change_after_delete();

CREATE OR REPLACE TRIGGER deferred_key_change_truncate AFTER TRUNCATE ON deferred_message
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_change_reset();
