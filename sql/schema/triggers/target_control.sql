-- The triggers of target_control, the per-target controls (pause, rate
-- limit, weight) an operator sets with plain SQL. A weight changes only
-- how claims share their rounds, which every claim reads afresh: it
-- notifies no one and flags no head.
--
-- CREATE OR REPLACE TRIGGER (PostgreSQL 14+), so that `scheduler migrate`
-- can apply this file again; see deferred_message.sql.

-- Dispatchers update tokens and refilled_at on every take; only an
-- operator's change of what a target may do should wake them all.
CREATE OR REPLACE TRIGGER target_control_changed AFTER INSERT OR DELETE ON target_control
    FOR EACH STATEMENT EXECUTE FUNCTION target_control_notify();

CREATE OR REPLACE TRIGGER target_control_updated AFTER UPDATE OF paused, rate_limit ON target_control
    FOR EACH STATEMENT EXECUTE FUNCTION target_control_notify();

-- A row trigger: it can name the columns, so the dispatchers' token takes
-- (tokens, refilled_at) do not fire it.
CREATE OR REPLACE TRIGGER target_control_throttle
    AFTER INSERT OR UPDATE OF target_topic, paused, rate_limit OR DELETE ON target_control
    FOR EACH ROW EXECUTE FUNCTION target_control_throttle();

-- TRUNCATE waits for every transaction that read target_control, so no
-- head writer can be flagging a head meanwhile.
CREATE OR REPLACE TRIGGER target_control_truncate AFTER TRUNCATE ON target_control
    FOR EACH STATEMENT EXECUTE FUNCTION target_control_after_truncate();

-- History of what operators set (target_control_history). Row triggers,
-- limited to the columns an operator sets and to real changes: the
-- dispatchers' token updates (tokens, refilled_at) never fire them.
CREATE OR REPLACE TRIGGER target_control_recorded AFTER INSERT OR DELETE ON target_control
    FOR EACH ROW EXECUTE FUNCTION target_control_record();

CREATE OR REPLACE TRIGGER target_control_changed_by AFTER UPDATE OF paused, rate_limit, note, weight ON target_control
    FOR EACH ROW
    WHEN (OLD.paused IS DISTINCT FROM NEW.paused OR OLD.rate_limit IS DISTINCT FROM NEW.rate_limit
          OR OLD.note IS DISTINCT FROM NEW.note OR OLD.weight IS DISTINCT FROM NEW.weight)
    EXECUTE FUNCTION target_control_record();
