-- The triggers of deferred_inflight, the keys consumer groups have not
-- committed past yet.
--
-- CREATE OR REPLACE TRIGGER (PostgreSQL 14+), so that `scheduler migrate`
-- can apply this file again; see deferred_message.sql.

-- A key whose last in-flight row goes may be claimed again: the release
-- after a group's commit and an operator's DELETE alike.
CREATE OR REPLACE TRIGGER deferred_inflight_released AFTER DELETE ON deferred_inflight
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_inflight_after_delete();

CREATE OR REPLACE TRIGGER deferred_inflight_truncated AFTER TRUNCATE ON deferred_inflight
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_inflight_after_truncate();

-- The consumers' blocked-key sets learn that the key may be free
-- (functions/deferred_key_change_released.sql); a TRUNCATE makes every
-- reader load its set again.
CREATE OR REPLACE TRIGGER deferred_key_change_released AFTER DELETE ON deferred_inflight
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_change_released();

CREATE OR REPLACE TRIGGER deferred_key_change_truncated AFTER TRUNCATE ON deferred_inflight
    FOR EACH STATEMENT EXECUTE FUNCTION deferred_key_change_reset();
