-- target_control_record: the AFTER row trigger of target_control that
-- records a change of a target's pause, rate limit, weight or note in
-- target_control_history, with who: the transaction's scheduler.actor
-- (operate.SetActor), else session_user (the role an operator with psql
-- logged in as; SECURITY DEFINER does not change it). Its triggers fire
-- only when one of those columns changes (triggers/target_control.sql), so
-- the dispatchers' token updates never reach it.

CREATE OR REPLACE FUNCTION target_control_record() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    actor text := coalesce(nullif(current_setting('scheduler.actor', true), ''), session_user::text);
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO target_control_history (target_topic, actor, change)
        VALUES (OLD.target_topic, actor, 'delete');
    ELSE
        INSERT INTO target_control_history (target_topic, actor, change, paused, rate_limit, note, weight)
        VALUES (NEW.target_topic, actor, lower(TG_OP), NEW.paused, NEW.rate_limit, NEW.note, NEW.weight);
    END IF;
    RETURN NULL;
END
$$;
