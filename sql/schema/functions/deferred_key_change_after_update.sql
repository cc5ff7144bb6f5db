-- deferred_key_change_after_update: an update that makes a message of a
-- consumer group start or stop blocking its key (replay, park without
-- holding the key, a fix of a rejected row), or moves it to another group
-- or key, is a change for the group's blocked-key sets
-- (deferred_key_change). Updates that leave it blocking as it was (an
-- expedite, a lease) write nothing.
CREATE OR REPLACE FUNCTION deferred_key_change_after_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO deferred_key_change (group_id, business_key)
    SELECT DISTINCT c.group_id, c.business_key
    FROM (
        SELECT o.id,
               o.group_id AS old_group, o.business_key AS old_key,
               (o.state IN ('pending', 'rejected') OR (o.state = 'parked' AND o.park_holds_key)) AS old_blocks,
               n.group_id AS new_group, n.business_key AS new_key,
               (n.state IN ('pending', 'rejected') OR (n.state = 'parked' AND n.park_holds_key)) AS new_blocks
        FROM old_rows o JOIN new_rows n USING (id)
    ) r
    CROSS JOIN LATERAL (VALUES (r.old_group, r.old_key, r.old_blocks), (r.new_group, r.new_key, r.new_blocks))
        AS c (group_id, business_key, blocks)
    WHERE c.blocks
      AND c.group_id IS NOT NULL AND c.business_key IS NOT NULL
      AND (r.old_blocks IS DISTINCT FROM r.new_blocks
           OR r.old_group IS DISTINCT FROM r.new_group
           OR r.old_key IS DISTINCT FROM r.new_key);
    RETURN NULL;
END
$$;
