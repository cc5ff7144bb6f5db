-- deferred_key_target: the targets that have heads neither paused nor
-- rate-limited (due or not, held or not), found by a loose scan of
-- deferred_key_target_due: one index probe per target, however many heads
-- each has. The claim shares its round between these targets
-- (sql/queries/dispatch_claim.sql, docs/design.md section 4.10), and the
-- backlog gauge counts held keys at each one's 'infinity' end.
--
-- CREATE OR REPLACE VIEW keeps the view's grants, but can only add columns
-- at the end: to drop, rename or retype one, drop the view in a numbered
-- migration (which re-applies this file after it).

CREATE OR REPLACE VIEW deferred_key_target AS
WITH RECURSIVE targets (target) AS (
    (SELECT k.head_target FROM deferred_key k
     WHERE NOT k.throttled AND k.head_target IS NOT NULL
     ORDER BY k.head_target
     LIMIT 1)
    UNION ALL
    SELECT (SELECT k.head_target FROM deferred_key k
            WHERE NOT k.throttled AND k.head_target > t.target
            ORDER BY k.head_target
            LIMIT 1)
    FROM targets t
    WHERE t.target IS NOT NULL
)
SELECT target FROM targets WHERE target IS NOT NULL;
