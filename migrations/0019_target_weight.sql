-- Targets share claims by weight.
--
-- Adds target_control.weight (1 to 100, default 1) and
-- target_control_history.weight. Changes sql/queries/dispatch_claim.sql,
-- which takes turns by weight, and the three claim statements, which
-- return each message's target weight (not definitions: the binary's own
-- statements), the trigger
-- target_control_changed_by of sql/schema/triggers/target_control.sql and
-- sql/schema/functions/target_control_record.sql, which now record a
-- change of the weight too.
--
-- A claim shares its round between the targets that have due heads, turn
-- by turn (docs/design.md section 4.10). Every target got one head per
-- turn; a target of weight w now gets w. An operator sets it with plain
-- SQL, sql/runbook/weight_target.sql or `scheduler weight` when one
-- service's retries must drain faster than another's while both have a
-- backlog. A target alone still gets the whole round, whatever its weight.
-- A process of an earlier release ignores the column and shares its own
-- claims equally, as before. target_control_record is a trigger function
-- grants.sql makes SECURITY DEFINER: run grants.sql again after this
-- migration, or an operator role's change of target_control fails for want
-- of rights on target_control_history.
ALTER TABLE target_control
    ADD COLUMN weight integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT target_control_weight_range CHECK (weight BETWEEN 1 AND 100);

ALTER TABLE target_control_history ADD COLUMN weight integer;

COMMENT ON TABLE target_control_history IS
    'Every change of a target''s pause, rate limit, weight or note in target_control, with who and when. Written by triggers on target_control.';
